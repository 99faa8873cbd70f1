"""The GPU path's checks that need no GPU.

What runs here is real: the runtime's reason for being unavailable, the project's Triton
kernel under Triton's interpreter against torch, that kernel compiled ahead of time to PTX for
GPUs this host lacks, and inductor's packaging (compile, save, load without compiling) on the
host CPU. Nothing here pretends to be a GPU; tests/gpu runs the same path on a real one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner.profile import DeviceProfile
from partitioner.split import split_program
from runtimes import registry
from runtimes import triton as triton_runtime
from runtimes.base import ROOT, TOLERANCE, CompileError, CompileSpec, RuntimeUnavailable
from runtimes.triton import (
    AOTI_BROKEN,
    TritonRuntime,
    aoti_check,
    aoti_selftest,
    child_verdict,
    compile_part,
    cuda_device,
    load_package_dir,
)

HERE = Path(__file__).resolve().parent  # the project's kernel lives next to this test
GPU = DeviceProfile(id="gpu0", kind="gpu", runtimes=["triton"])
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                                   reason="a CUDA device is present: tests/gpu covers this host")


def small_part() -> tuple[nn.Module, torch.fx.GraphModule, torch.Tensor]:
    """A Linear -> GELU -> Linear model as one part, the way the engine gets parts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    x = torch.randn(2, 16)
    exported = torch.export.export(model, (x,))
    names = [n.name for n in exported.graph.nodes if n.op == "call_function"]
    return model, split_program(exported, {name: "p0" for name in names}).parts[0].module, x


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ---- availability ------------------------------------------------------------------------

@needs_no_cuda
def test_unavailable_says_why() -> None:
    reason = TritonRuntime.unavailable()
    assert reason is not None and "no CUDA device" in reason


@needs_no_cuda
def test_registry_reports_triton_unavailable() -> None:
    assert registry.runtime_class("triton") is TritonRuntime  # importing costs nothing
    report = registry.report()
    assert "no CUDA device" in (report["triton"] or "")
    with pytest.raises(RuntimeUnavailable, match="'triton' is unavailable: no CUDA device"):
        registry.get("triton")


@needs_no_cuda
def test_compile_without_cuda_is_refused_cleanly() -> None:
    _, part, x = small_part()
    with pytest.raises(RuntimeUnavailable, match="no CUDA device"):
        TritonRuntime().compile(part, CompileSpec(GPU, example_inputs=[x]))


def test_profile_maps_to_cuda_device() -> None:
    assert cuda_device(GPU) == torch.device("cuda", 0)
    assert cuda_device(DeviceProfile(id="gpu3", kind="gpu")) == torch.device("cuda", 3)
    with pytest.raises(CompileError, match="'npu0'"):
        cuda_device(DeviceProfile(id="npu0", kind="npu"))


def test_targets() -> None:
    runtime = TritonRuntime()
    assert runtime.can_target(GPU, "fp32") and runtime.can_target(GPU, "bf16")
    assert runtime.can_target(GPU, "fp16") and not runtime.can_target(GPU, "int8")
    assert not runtime.can_target(DeviceProfile(id="cpu0", kind="cpu"), "fp32")


# ---- the project's kernel ----------------------------------------------------------------

INTERPRETED = """
import json
import torch
from triton_kernels import BLOCK, bias_gelu

torch.manual_seed(0)
errors = {}
# 3 x 700 is not a multiple of BLOCK: the masked tail is exercised too.
for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
    x, bias = torch.randn(3, 700).to(dtype), torch.randn(700).to(dtype)
    out = bias_gelu(x, bias)
    ref = torch.nn.functional.gelu(x.float() + bias.float())
    assert out.dtype == dtype and out.shape == x.shape, (out.dtype, out.shape)
    errors[name] = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
print(json.dumps(errors))
"""


def test_kernel_matches_torch_under_interpreter() -> None:
    # TRITON_INTERPRET must be set before triton is imported: a fresh interpreter it is.
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert errors["fp32"] < 1e-6, errors
    assert errors["bf16"] < TOLERANCE["bf16"] and errors["fp16"] < TOLERANCE["fp16"], errors


def test_kernel_rejects_mismatched_bias() -> None:
    from triton_kernels import bias_gelu

    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        bias_gelu(torch.zeros(2, 8), torch.zeros(4))


@pytest.mark.parametrize("arch", [80, 90])
def test_kernel_compiles_ahead_to_ptx(arch: int) -> None:
    from triton_kernels import compile_ahead

    stages = compile_ahead(arch)
    ptx = stages["ptx"]
    assert isinstance(ptx, str) and ".entry bias_gelu_kernel" in ptx
    # sm_90 kernels are emitted for sm_90a (Hopper's arch-specific features): same prefix.
    assert f".target sm_{arch}" in ptx
    # triton bundles ptxas, so a cubin comes out too where that binary runs on this host.
    if "cubin" in stages:
        assert bytes(stages["cubin"][:4]) == b"\x7fELF"


def test_kernel_compiles_ahead_in_bf16() -> None:
    from triton_kernels import compile_ahead

    assert ".target sm_90" in compile_ahead(90, torch.bfloat16)["ptx"]


# ---- inductor packaging, on the host CPU --------------------------------------------------

@pytest.mark.slow
def test_package_save_and_load_on_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compile -> save -> load -> run through AOTInductor, on the CPU (tens of seconds cold).

    Same code as on a GPU but for the device: it checks the packaging, the precision casts and
    that loading compiles nothing. What it cannot check, inductor's Triton output, tests/gpu does.
    """
    model, part, x = small_part()
    cpu = torch.device("cpu")
    executable = compile_part(part, [x], cpu, "fp32")
    assert executable.path == "aoti", executable.aoti_error
    out = executable.run([x])
    assert len(out) == 1 and out[0].dtype == torch.float32
    assert relative_error(out[0], model(x).detach()) < TOLERANCE["fp32"]
    executable.save(tmp_path)

    def no_compiling(*args: object, **kwargs: object) -> None:
        raise AssertionError("load compiled")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiling)  # noqa: SLF001 - AOTInductor's API
    monkeypatch.setattr(torch, "compile", no_compiling)
    loaded = load_package_dir(tmp_path, cpu, "fp32")
    assert torch.equal(loaded.run([x])[0], out[0])
    with pytest.raises(CompileError, match="precision"):
        load_package_dir(tmp_path, cpu, "bf16")  # a saved fp32 part is not a bf16 part


@pytest.mark.slow
def test_bf16_part_returns_fp32_on_host() -> None:
    model, part, x = small_part()
    executable = compile_part(part, [x], torch.device("cpu"), "bf16")
    (out,) = executable.run([x])
    assert out.dtype == torch.float32  # cast back to the inputs' dtype on the way out
    assert relative_error(out, model(x).detach()) < TOLERANCE["bf16"]
    assert all(b.dtype == torch.float32 for b in part.buffers())  # the caller's part untouched


@pytest.mark.slow
def test_without_aotinductor_a_part_is_saved_and_loads_in_a_fresh_process_uncompiled(
        tmp_path: Path) -> None:
    """standalone_compile's artifact in cuvild's compile cache: a new process (a restarted
    worker) loads it with nothing traced or compiled (compile_fx and torch.compile made to
    fail there) and answers what the compiling process answered, within eager's tolerance."""
    import numpy as np

    model, part, x = small_part()
    cpu = torch.device("cpu")
    executable = compile_part(part, [x], cpu, "fp32", aoti=False)
    assert executable.path == "standalone" and executable.package is None
    (out,) = executable.run([x])
    assert relative_error(out, model(x).detach()) < TOLERANCE["fp32"]
    executable.save(tmp_path / "part")
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "out.npy", out.numpy())
    child = f"""
from pathlib import Path
import numpy as np, torch
import torch._inductor.compile_fx as compile_fx
from runtimes.triton import load_package_dir
def no(*a, **k): raise AssertionError("compiled on load")
compile_fx.compile_fx = compile_fx.compile_fx_inner = torch.compile = no
part = load_package_dir(Path({str(tmp_path / "part")!r}), torch.device("cpu"), "fp32")
assert part.path == "standalone", part.path
(got,) = part.run([torch.from_numpy(np.load({str(tmp_path / "x.npy")!r}))])
want = torch.from_numpy(np.load({str(tmp_path / "out.npy")!r}))
assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
print("loaded uncompiled")
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0 and "loaded uncompiled" in done.stdout, done.stderr[-2000:]


@pytest.mark.slow
def test_torch_compile_fallback_on_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where standalone_compile fails too: torch.compile, which saves nothing (and says so)."""
    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no standalone_compile here")

    monkeypatch.setattr(torch._inductor, "standalone_compile", fails)  # noqa: SLF001 - inductor's API
    model, part, x = small_part()
    executable = compile_part(part, [x], torch.device("cpu"), "fp32", aoti=False)
    assert executable.path == "torch.compile" and executable.package is None
    assert relative_error(executable.run([x])[0], model(x).detach()) < TOLERANCE["fp32"]
    with pytest.raises(NotImplementedError, match="torch.compile"):
        executable.save(Path("/nonexistent"))


# ---- AOTInductor's check (a measured GPU profile says aoti-broken where it fails) ----------

def test_aoti_check_passes_where_aotinductor_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check the GPU profile runs, on the host CPU: compile, load and run (here in this
    process: a child would import torch and warm inductor again, ~8 s on 2 cores), and the
    child's command calls that very check for the device it was given."""
    aoti_selftest(torch.device("cpu"))
    commands: list[list[str]] = []
    monkeypatch.setattr(triton_runtime, "child_verdict",
                        lambda command, timeout_s: commands.append(command))
    assert aoti_check(torch.device("cpu")) is None
    ((python, flag, code),) = commands
    assert (python, flag) == (sys.executable, "-c")
    checked: list[torch.device] = []
    monkeypatch.setattr(triton_runtime, "aoti_selftest", checked.append)
    exec(code, {})  # noqa: S102 - the child's own line, with the check recorded
    assert checked == [torch.device("cpu")]


def test_a_check_that_crashes_says_so() -> None:
    """As AOTInductor's package load did on the lent H200 (torch 2.11): SIGSEGV."""
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    assert "killed by SIGSEGV" in (child_verdict(crash, 60) or "")
    fails = [sys.executable, "-c", "raise RuntimeError('no nvcc')"]
    assert child_verdict(fails, 60) == "the AOTInductor check failed: RuntimeError: no nvcc"


def test_a_profile_marked_aoti_broken_compiles_without_aotinductor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, part, x = small_part()
    asked: list[bool] = []

    def compile_part_(part: object, inputs: object, device: object, precision: str,
                      aoti: bool = True) -> Any:
        asked.append(aoti)
        return compile_part(part, inputs, torch.device("cpu"), precision, aoti=False)

    monkeypatch.setattr(triton_runtime, "compile_part", compile_part_)
    monkeypatch.setattr(TritonRuntime, "_device", lambda self, spec: torch.device("cpu"))
    broken = DeviceProfile(id="gpu0", kind="gpu", runtimes=["triton"], features=[AOTI_BROKEN])
    executable = TritonRuntime(aoti=True).compile(part, CompileSpec(broken, "fp32", [x]))
    TritonRuntime(aoti=True).compile(part, CompileSpec(GPU, "fp32", [x]))
    assert asked == [False, True]
    assert executable.path == "standalone"  # saved in the compile cache all the same
    assert "aoti-broken" in (executable.aoti_error or "")


@pytest.mark.slow
def test_a_compiled_parts_call_and_kernel_cost_are_timed_through_run() -> None:
    """The cost model's GPU prior (runtimes/profiling/calls.py), exercised on the host: two
    parts of 1 and 4 layers compiled by inductor, timed through `run`; the call and
    per-kernel cost come out as times, never negative (what they are is the host's business:
    on a busy 2-core host the 4-layer part's extra time can exceed the 1-layer part's whole
    call, which then reads 0); the arithmetic on given times is checked exactly."""
    from runtimes.profiling.benchmarks import median_call_us
    from runtimes.profiling.calls import compiled_call_us, probe_part

    part, (x,) = probe_part(3)
    assert sum(n.op == "placeholder" for n in part.graph.nodes) == 1  # its weights are its own
    got = compiled_call_us(lambda p, inputs: compile_part(p, inputs, torch.device("cpu"),
                                                          aoti=False),
                           lambda run: median_call_us(run, calls=30), kernels=4)
    assert set(got) == {"call_us", "kernel_us"}
    assert got["call_us"] >= 0 and got["kernel_us"] >= 0, got
    # kernel = (t(4) - t(1)) / 3, call = t(1) - kernel, on times given in that order
    given = iter([50.0, 80.0])

    class Built:  # (what is timed does not matter here)
        def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            return list(inputs)

    assert compiled_call_us(lambda p, inputs: Built(), lambda run: next(given),
                            kernels=4) == {"call_us": 40.0, "kernel_us": 10.0}
