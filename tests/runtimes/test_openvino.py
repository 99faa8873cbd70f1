"""OpenVINO runtime: reference models whole and split in two, fp32 and bf16 against torch eager,
the compile cache, the emulated NPU and the not-installed state. CPU plugin only."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from cuvild.client.samples import reference
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
from runtimes.profiling.hardware import cpuinfo

# torch's pytree deprecation, raised inside torch.export / OpenVINO's frontend, not here.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
pytest.importorskip("openvino")
import openvino  # noqa: E402

from runtimes.openvino import OpenVINORuntime, ov_device  # noqa: E402

MODELS = ("resnet18", "bert4", "mlp")
THREADS = min(2, len(os.sched_getaffinity(0)))


BF16_FLAGS = {"amx_bf16", "avx512_bf16"} & set(cpuinfo()["flags"])
CPU = DeviceProfile(id="cpu0", kind="cpu", cores=list(range(THREADS)),
                    features=sorted(BF16_FLAGS), runtimes=["openvino"])
EMULATED_NPU = DeviceProfile(id="npu0", kind="npu", emulated=True, cores=[1],
                             runtimes=["openvino"])




class Case:
    """One reference model at batch 1: its eager outputs and its whole/half splits."""

    def __init__(self, name: str) -> None:
        model, self.inputs = reference(name, 1)
        with torch.inference_mode():
            out = model(*self.inputs)
        self.expected = list(out) if isinstance(out, tuple) else [out]
        self.ep = export(model, self.inputs)
        compute = [n.name for n in self.ep.graph.nodes if n.op == "call_function"]
        half = len(compute) // 2
        self.splits = {
            "whole": split_program(self.ep, {n: "all" for n in compute}),
            "half": split_program(self.ep, {n: "a" if i < half else "b"
                                            for i, n in enumerate(compute)}),
        }

    def compile(self, split: str, device: DeviceProfile, precision: str) -> dict[str, Executable]:
        program = self.splits[split]
        values = program.trace(*self.inputs)
        runtime = OpenVINORuntime()
        return {p.id: runtime.compile(p.module, CompileSpec(
            device=device, precision=precision, threads=max(len(device.cores), 1),
            example_inputs=[values[n].detach() for n in p.inputs])) for p in program.parts}


def run_split(program: SplitProgram, executables: dict[str, Executable],
              inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    values: dict[str, Any] = dict(zip(program.inputs, inputs, strict=True))
    for part in program.parts:
        outputs = executables[part.id].run([values[n] for n in part.inputs])
        values.update(zip(part.outputs, outputs, strict=True))
    return [values[n] for n in program.outputs]


@pytest.fixture(scope="module")
def cases() -> Callable[[str], Case]:
    """Each reference model exported once for the module."""
    made: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in made:
            made[name] = Case(name)
        return made[name]

    return get


@pytest.fixture(scope="module")
def compiled(cases: Callable[[str], Case]) -> Callable[..., dict[str, Executable]]:
    """Executables shared by the tests of this module, compiled on first use."""
    made: dict[tuple[str, str, str], dict[str, Executable]] = {}

    def get(name: str, split: str, precision: str = "fp32") -> dict[str, Executable]:
        key = (name, split, precision)
        if key not in made:
            made[key] = cases(name).compile(split, CPU, precision)
        return made[key]

    return get


@pytest.mark.parametrize("split", ["whole", "half"])
@pytest.mark.parametrize("name", MODELS)
def test_fp32_matches_eager(cases: Callable[[str], Case], compiled: Callable[..., Any],
                            name: str, split: str) -> None:
    case = cases(name)
    executables = compiled(name, split)
    assert len(executables) == (1 if split == "whole" else 2)
    outputs = run_split(case.splits[split], executables, case.inputs)
    assert relative_error(outputs, case.expected) <= TOLERANCE["fp32"]


def test_precision_is_set_explicitly(compiled: Callable[..., Any]) -> None:
    # On an AMX CPU the plugin would pick bf16 by itself; fp32 must stay fp32.
    (exe,) = compiled("mlp", "whole").values()
    assert exe.compiled.get_property("INFERENCE_PRECISION_HINT") == openvino.Type.f32
    assert exe.compiled.get_property("INFERENCE_NUM_THREADS") == THREADS
    assert all(i.get_partial_shape().is_static for i in exe.compiled.inputs)


@pytest.mark.parametrize("name", ["resnet18", "bert4"])  # convolutions; attention and matmuls
def test_bf16_within_tolerance(cases: Callable[[str], Case], compiled: Callable[..., Any],
                               name: str) -> None:
    if not BF16_FLAGS:
        reason = "this CPU has neither amx_bf16 nor avx512_bf16 in /proc/cpuinfo"
        print(f"skipping bf16: {reason}")
        pytest.skip(reason)
    case = cases(name)
    executables = compiled(name, "whole", "bf16")
    (exe,) = executables.values()
    assert exe.compiled.get_property("INFERENCE_PRECISION_HINT") == openvino.Type.bf16
    error = relative_error(run_split(case.splits["whole"], executables, case.inputs),
                           case.expected)
    assert 0 < error <= TOLERANCE["bf16"]  # > 0: it really ran in bf16


def test_save_load_does_not_convert(cases: Callable[[str], Case],
                                    compiled: Callable[..., Any], tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    case = cases("resnet18")
    (exe,) = compiled("resnet18", "whole").values()
    exe.save(tmp_path)
    assert (tmp_path / "part.xml").exists() and (tmp_path / "part.bin").exists()
    before = exe.run(case.inputs)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("load must not convert or export again")

    monkeypatch.setattr(openvino, "convert_model", refuse)
    monkeypatch.setattr(torch.export, "export", refuse)
    spec = CompileSpec(device=CPU, precision="fp32", threads=THREADS,
                       example_inputs=list(case.inputs))
    loaded = OpenVINORuntime().load(tmp_path, spec)
    assert relative_error(loaded.run(case.inputs), before) <= 1e-6


def test_load_imports_a_blob_without_compiling(cases: Callable[[str], Case],
                                               compiled: Callable[..., Any], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # NPU and GPU entries carry a compiled blob; the CPU plugin exports one too, so the
    # import path is checked here by adding the blob to a CPU entry by hand.
    case = cases("resnet18")
    (exe,) = compiled("resnet18", "whole").values()
    exe.save(tmp_path)
    blob = exe.compiled.export_model()
    (tmp_path / "part.blob").write_bytes(blob.getvalue() if hasattr(blob, "getvalue") else blob)
    meta = json.loads((tmp_path / "openvino.json").read_text())
    (tmp_path / "openvino.json").write_text(json.dumps({**meta, "blob": True}))

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cached blob must be imported, not compiled")

    monkeypatch.setattr(openvino.Core, "compile_model", refuse)
    spec = CompileSpec(device=CPU, precision="fp32", threads=THREADS,
                       example_inputs=list(case.inputs))
    loaded = OpenVINORuntime().load(tmp_path, spec)
    assert relative_error(loaded.run(case.inputs), exe.run(case.inputs)) <= 1e-6


def test_emulated_npu_runs_on_cpu_plugin(cases: Callable[[str], Case]) -> None:
    assert ov_device(EMULATED_NPU) == "CPU"
    case = cases("demo")  # the demo model pins its backbone to the NPU
    executables = case.compile("whole", EMULATED_NPU, "fp32")
    (exe,) = executables.values()
    assert exe.meta["device"] == "CPU"
    assert list(exe.compiled.get_property("EXECUTION_DEVICES")) == ["CPU"]
    assert exe.compiled.get_property("INFERENCE_NUM_THREADS") == 1  # its one core
    assert all(i.get_partial_shape().is_static for i in exe.compiled.inputs)
    outputs = run_split(case.splits["whole"], executables, case.inputs)
    assert relative_error(outputs, case.expected) <= TOLERANCE["fp32"]


def test_devices_and_precisions() -> None:
    runtime = OpenVINORuntime()
    real_npu = DeviceProfile(id="npu0", kind="npu", runtimes=["openvino"])
    cuda_gpu = DeviceProfile(id="gpu0", kind="gpu", runtimes=["triton"])
    intel_gpu = DeviceProfile(id="gpu1", kind="gpu", runtimes=["openvino"])
    plain_cpu = DeviceProfile(id="cpu0", kind="cpu", features=["avx2"])
    assert (ov_device(real_npu), ov_device(intel_gpu), ov_device(cuda_gpu)) == ("NPU", "GPU", None)
    assert runtime.can_target(real_npu, "fp16") and not runtime.can_target(real_npu, "fp32")
    assert runtime.can_target(intel_gpu, "fp32") and not runtime.can_target(intel_gpu, "bf16")
    assert not runtime.can_target(cuda_gpu, "fp32")
    assert runtime.can_target(plain_cpu, "fp32") and not runtime.can_target(plain_cpu, "bf16")
    with pytest.raises(CompileError, match="cannot target"):
        runtime.compile(torch.fx.symbolic_trace(torch.nn.ReLU()), CompileSpec(
            device=plain_cpu, precision="bf16", example_inputs=[torch.ones(2)]))


def test_supports_rejects_ops_that_do_not_convert() -> None:
    class Inverse(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.linalg.inv(x).relu()

    x = torch.eye(3) * 2
    ep = export(Inverse(), (x,))
    verdicts = {str(n.target): OpenVINORuntime().supports(n)
                for n in ep.graph.nodes if n.op == "call_function"}
    assert verdicts == {"aten.linalg_inv.default": False, "aten.relu.default": True}
    part = split_program(ep, {n.name: "all" for n in ep.graph.nodes
                              if n.op == "call_function"}).parts[0]
    with pytest.raises(CompileError, match="convert_model"):
        OpenVINORuntime().compile(part.module, CompileSpec(device=CPU, example_inputs=[x]))


def test_unavailable_when_openvino_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert OpenVINORuntime.unavailable() is None
    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino now fails
    reason = OpenVINORuntime.unavailable()
    assert isinstance(reason, str) and "openvino" in reason
    with pytest.raises(RuntimeUnavailable, match="openvino"):
        registry.get("openvino")


FP16_FLAGS = {"avx512_fp16", "amx_fp16"} & set(cpuinfo()["flags"])
CLAIMS_FP16 = DeviceProfile(id="cpu0", kind="cpu", cores=list(range(THREADS)),
                            features=["avx512_fp16"], runtimes=["openvino"])


def overflowing_linear() -> tuple[torch.fx.GraphModule, torch.Tensor, torch.Tensor]:
    """A Linear fed values past fp16's 65,504: in fp16 its outputs are inf/NaN or clipped."""
    torch.manual_seed(0)
    linear, x = torch.nn.Linear(8, 8).eval(), torch.randn(2, 8) * 1e6
    with torch.no_grad():
        return torch.fx.symbolic_trace(linear), x, linear(x)


def test_fp16_on_a_cpu_without_it_is_refused_not_run_as_bf16() -> None:
    """The label is what ran: OpenVINO's CPU plugin turns an f16 hint into bf16 (or f32) on a
    CPU without avx512_fp16, silently; a build labelled fp16 that ran bf16 would pass an
    fp16 overflow test (bf16 has fp32's range). So the compile refuses it, naming both."""
    if FP16_FLAGS:
        pytest.skip("this CPU has avx512_fp16: see test_fp16_on_a_cpu_with_it_overflows")
    module, x, _ = overflowing_linear()
    with pytest.raises(CompileError, match=r"runs (bf16|f32) when asked for f16 \(fp16\)"):
        OpenVINORuntime().compile(module, CompileSpec(device=CLAIMS_FP16, precision="fp16",
                                                      threads=THREADS, example_inputs=[x]))


def test_fp16_on_a_cpu_with_it_overflows() -> None:
    """Where the CPU runs fp16, the part really computes in fp16: fed past fp16's range, its
    outputs are far from eager's (the check then refuses it; tests/serve/test_waiting.py)."""
    if not FP16_FLAGS:
        reason = "this CPU has neither avx512_fp16 nor amx_fp16 in /proc/cpuinfo"
        print(f"skipping fp16: {reason}")
        pytest.skip(reason)
    module, x, expected = overflowing_linear()
    exe = OpenVINORuntime().compile(module, CompileSpec(device=CLAIMS_FP16, precision="fp16",
                                                        threads=THREADS, example_inputs=[x]))
    assert exe.compiled.get_property("INFERENCE_PRECISION_HINT") == openvino.Type.f16
    assert relative_error(exe.run([x]), [expected]) > TOLERANCE["fp16"]


def test_int8_with_fp32_back_off_stops_at_its_time_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NNCF's accuracy control compiles and validates once per op it puts back (the BERT-like
    encoder's search took 324 s); past MIX_SEARCH_S the search stops and says so."""
    pytest.importorskip("nncf", reason="NNCF (int8 post-training quantization) is missing")
    from runtimes import openvino as ov_runtime

    monkeypatch.setattr(ov_runtime, "MIX_SEARCH_S", 0.0)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 8)).eval()
    x = torch.randn(4, 32)
    exported = export(mlp, (x,))
    part = split_program(exported, {n.name: "p0" for n in exported.graph.nodes
                                    if n.op == "call_function"}).parts[0].module
    spec = CompileSpec(device=CPU, precision=ov_runtime.INT8_MIXED, threads=THREADS,
                       example_inputs=[x], calibration=[[torch.randn(4, 32)] for _ in range(4)],
                       max_error=1e-6)
    with pytest.raises(CompileError, match=r"int8\+fp32: NNCF's accuracy control did not hold "
                                           r"1e-06 within 0 s \(\d+ validations\): not built"):
        OpenVINORuntime().compile(part, spec)


def test_an_op_openvino_named_is_reported_by_the_models_name_near_it():
    """NNCF's kept-fp32 notes name the model's nodes: an op OpenVINO made itself
    ("MatMul_51935") takes the name of the torch.export node next to it (issue 48)."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    from runtimes.openvino import graph_name

    x = ops.parameter([2, 4], np.float32, name="x")
    made = ops.matmul(x, ops.constant(np.ones((4, 4), np.float32)), False, False)
    made.set_friendly_name("MatMul_51935")
    named = ops.add(made, ops.constant(np.ones((4,), np.float32)))
    named.set_friendly_name("linear_3/aten.linear.default/Add")
    ov.Model([named], [x])
    assert graph_name(named) == "linear_3"
    assert graph_name(made) == "near linear_3"


def test_no_telemetry_leaves_a_process_that_builds_with_openvino() -> None:
    """OpenVINO's conversion and NNCF send Google Analytics telemetry unless told not to;
    a process of cuvild's runtimes runs their no-telemetry fallback (runtimes/__init__.py).
    In a fresh interpreter, as a worker starts: not in this one, whose pytest NNCF sees."""
    import subprocess

    code = ("import runtimes.openvino, openvino, nncf\n"
            "import openvino.tools.ovc.convert_impl as ovc, nncf.telemetry.wrapper as w\n"
            "assert ovc.tm.__name__ == 'openvino.tools.ovc.telemetry_stub', ovc.tm\n"
            "assert not isinstance(w.telemetry, w.NNCFTelemetry), w.telemetry\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for name in ("CI", "TF_BUILD", "JENKINS_URL"):  # (each turns theirs off on its own)
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
