"""One GPU part at a time, for the lease script (check_gpu.py's `parts` and `aoti` sections).

Per row (model, batch, precision; ROWS), the part compiled by TritonRuntime as the daemon
compiles it, then, each a p50 over REPS runs on the same card:
- kernel by kernel: `run` with host tensors in and out (today's part), from pinned and from
  pageable inputs;
- as a CUDA graph: `run_into` (runtimes/graphs.py) from pinned and pageable inputs into
  pinned places; its replay alone on the device;
- the references: a manual `torch.cuda.graph` capture and replay of the same compiled
  function on device-resident inputs, and with the same pinned copies in and out;
  `torch.compile` (default mode) of the model on the device;
- `torch.profiler`: kernels launched, GPU busy time and wall per run, kernel by kernel and
  as a graph; peak GPU memory of a run;
- the restart path: save, load in this process (nothing compiled), first run after load.

`aoti_variants` tries AOTInductor's package three ways, each loaded in a fresh process
(faulthandler on, and under gdb for a native backtrace where gdb is installed): as built,
with `run_single_threaded=True`, and with the constants outside the .so.

Every function returns plain data and raises nothing a row can catch; without CUDA each row
says "no CUDA device".
"""

from __future__ import annotations

import copy
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ROWS = (("resnet18", 1, "fp32"), ("resnet18", 1, "bf16"), ("bert4", 1, "fp32"),
        ("resnet18", 16, "bf16"))
WARMUP, REPS = 10, 50
DEVICE = "cuda"  # `python tests/gpu/check_parts.py --cpu` dry-runs the rows' code on the CPU


def cuda() -> bool:
    return DEVICE == "cuda"


def sync() -> None:
    import torch

    if cuda():
        torch.cuda.synchronize()


def pinned(t: Any) -> Any:
    return t.pin_memory() if cuda() else t


def no_cuda() -> str | None:
    import torch

    return None if not cuda() or torch.cuda.is_available() else "no CUDA device"


def ms(fn: Callable[[], Any], reps: int = REPS) -> float:
    for _ in range(WARMUP):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return round(statistics.median(samples) * 1e3, 4)


def error(out: Any, ref: Any) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def profiled(fn: Callable[[], Any], runs: int = 10) -> dict[str, Any]:
    """Kernels launched, GPU busy ms and wall ms per run, by torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not cuda():
        return {"skipped": "the CPU dry run"}
    fn()
    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        sync()
    wall = (time.perf_counter() - t0) / runs
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(getattr(e, "device_time", getattr(e, "cuda_time", 0.0)) for e in kernels)
    return {"kernels_per_run": round(len(kernels) / runs, 1),
            "gpu_busy_ms": round(busy / runs / 1e3, 4), "wall_ms": round(wall * 1e3, 4)}


def peak_mb(fn: Callable[[], Any]) -> float:
    import torch

    if not cuda():
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 1e6, 2)


def manual_graph(fn: Callable[[], Any], inputs: list[Any], host: list[Any],
                 out_host: Any) -> dict[str, float]:
    """torch.cuda.graph of `fn` over device inputs: replay alone, and with the copies in
    from `host` (pinned) and out to `out_host` (pinned)."""
    import torch

    if not cuda():
        return {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    out = out[0] if isinstance(out, (list, tuple)) else out

    def with_copies() -> None:
        for d, h in zip(inputs, host, strict=True):
            d.copy_(h, non_blocking=True)
        graph.replay()
        out_host.copy_(out.to(out_host.dtype), non_blocking=True)

    return {"manual_graph_replay_ms": ms(graph.replay), "manual_graph_host_io_ms":
            ms(with_copies)}


def row(name: str, batch: int, precision: str, scratch: Path) -> dict[str, Any]:
    import torch

    from cuvild.client.samples import reference
    from partitioner.profile import DeviceProfile
    from partitioner.split import split_program
    from runtimes.base import CompileSpec
    from runtimes.triton import DTYPES, TritonRuntime, _math, compile_part, device_input

    dev = torch.device(DEVICE, 0)
    module, args = reference(name, batch)
    with torch.inference_mode():
        expected = module(*args)
    ep = torch.export.export(module, args)
    part = split_program(ep, {n.name: "p0" for n in ep.graph.nodes
                              if n.op == "call_function"}).parts[0].module
    spec = CompileSpec(DeviceProfile(id="gpu0", kind="gpu", runtimes=["triton"]), precision,
                       list(args))
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    exe = (TritonRuntime().compile(part, spec) if cuda()
           else compile_part(part, list(args), dev, precision, aoti=False))
    out.update(cold_compile_s=round(time.perf_counter() - t0, 2), path=exe.path)
    if exe.aoti_error:
        out["aoti_error"] = exe.aoti_error[:1000]
    pinned_args = [pinned(a) for a in args]
    first = exe.run(list(args))[0]
    out["error_vs_cpu_fp32"] = error(first, expected)
    out["kernel_by_kernel_ms"] = ms(lambda: exe.run(pinned_args))
    out["kernel_by_kernel_pageable_ms"] = ms(lambda: exe.run(list(args)))
    compute = DTYPES[precision]
    dev_args = [device_input(a, dev, compute) for a in args]
    places = [pinned(torch.empty(first.shape, dtype=first.dtype))]

    def call() -> Any:
        return exe.model(*exe.weights, *dev_args)

    with torch.inference_mode(), _math(dev, compute):
        out["kernel_by_kernel_device_ms"] = ms(call)
        out["profile_kernel_by_kernel"] = profiled(call)
        out["peak_mb_kernel_by_kernel"] = peak_mb(call)
        out.update(manual_graph(call, dev_args, [pinned(p.to(compute)) for p in pinned_args],
                                places[0]))
    got = _as_graph(exe, pinned_args, list(args), places, expected, out)
    eager = copy.deepcopy(module).to(device=dev, dtype=compute)
    with torch.inference_mode(), _math(dev, compute):
        compiled = torch.compile(eager)
        t0 = time.perf_counter()
        compiled(*dev_args)
        out["torch_compile_s"] = round(time.perf_counter() - t0, 2)
        out["torch_compile_device_ms"] = ms(lambda: compiled(*dev_args))
    _ratios(out)
    if exe.path != "torch.compile":  # the restart path: load what was saved, compile nothing
        out.update(_restart(exe, spec, scratch / f"{name}-{batch}-{precision}", pinned_args,
                            got))
    return out


def _restart(exe: Any, spec: Any, saved: Path, pinned: list[Any], got: Any) -> dict[str, Any]:
    import torch

    from runtimes.triton import TritonRuntime, load_package_dir

    exe.save(saved)
    t0 = time.perf_counter()
    loaded = (TritonRuntime().load(saved, spec) if cuda()
              else load_package_dir(saved, exe.device, exe.precision))
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = loaded.run_into(pinned, [torch.empty_like(got)])[0]
    return {"restart_load_s": round(load_s, 3),
            "restart_first_run_ms": round((time.perf_counter() - t0) * 1e3, 2),
            "restart_matches": bool(torch.allclose(again, got, rtol=1e-3, atol=1e-4))}


def _as_graph(exe: Any, pinned: list[Any], pageable: list[Any], places: list[Any],
              expected: Any, out: dict[str, Any]) -> Any:
    """The part through `run_into` (captured as a CUDA graph at its first call)."""
    got = exe.run_into(pinned, places)[0]
    out["graph"] = exe.graph
    if exe.graphed is not None:
        out["graph_error_vs_cpu_fp32"] = error(got, expected)
        out["graph_ms"] = ms(lambda: exe.run_into(pinned, places))
        out["graph_pageable_ms"] = ms(lambda: exe.run_into(pageable, places))
        replay = exe.graphed.captured.replay
        out["graph_replay_ms"] = ms(replay)
        out["profile_graph"] = profiled(lambda: exe.run_into(pinned, places))
        out["peak_mb_graph_replay"] = peak_mb(replay)
    return got.clone()


def _ratios(out: dict[str, Any]) -> None:
    def ratio(a: str, b: str) -> float | None:
        return round(out[a] / out[b], 3) if out.get(a) and out.get(b) else None

    out["ratios"] = {
        "graph_over_manual_graph_host_io": ratio("graph_ms", "manual_graph_host_io_ms"),
        "graph_replay_over_manual_replay": ratio("graph_replay_ms", "manual_graph_replay_ms"),
        "kernel_by_kernel_over_graph": ratio("kernel_by_kernel_ms", "graph_ms"),
        "graph_replay_over_torch_compile": ratio("graph_replay_ms", "torch_compile_device_ms"),
        "graph_over_torch_compile": ratio("graph_ms", "torch_compile_device_ms"),
    }


def parts(deadline: Callable[[], float], keep: Callable[[str, Any], None]) -> None:
    """Every row of ROWS while time is left, each kept as it ends."""
    reason = no_cuda()
    scratch = Path(tempfile.mkdtemp(prefix="cuvild-parts-"))
    try:
        for name, batch, precision in ROWS:
            key = f"{name}_b{batch}_{precision}"
            if reason or deadline() <= 0:
                keep(key, reason or "skipped: past the time budget")
                continue
            try:
                keep(key, row(name, batch, precision, scratch))
            except Exception as e:
                traceback.print_exc()
                keep(key, {"error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"{key}: done", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# ---- AOTInductor, three ways, each loaded in a fresh process -------------------------------

LOAD = """
import faulthandler, sys, time, json
faulthandler.enable()
import torch
t0 = time.perf_counter()
runner = torch._inductor.aoti_load_package(sys.argv[1], run_single_threaded=sys.argv[2] == "1")
load_s = time.perf_counter() - t0
x = torch.randn(1, 3, 224, 224, device="cuda")
out = runner(x)
torch.cuda.synchronize()
print(json.dumps({"load_s": round(load_s, 3), "ok": True}))
"""


def aoti_variants(deadline: Callable[[], float], keep: Callable[[str, Any], None]) -> None:
    reason = no_cuda()
    if reason:
        keep("aoti", reason)
        return
    import torch

    from cuvild.client.samples import reference

    scratch = Path(tempfile.mkdtemp(prefix="cuvild-aoti-"))
    module, args = reference("resnet18", 1)
    module = module.to("cuda")
    dev_args = tuple(a.to("cuda") for a in args)
    variants = (("as_built", {}, "0"), ("run_single_threaded", {}, "1"),
                ("constants_outside_so", {"aot_inductor.package_constants_in_so": False,
                                          "aot_inductor.package_constants_on_disk_format":
                                          "binary_blob"}, "0"))
    packages: dict[str, str] = {}
    try:
        for label, configs, single in variants:
            if deadline() <= 0:
                keep(f"aoti_{label}", "skipped: past the time budget")
                continue
            result: dict[str, Any] = {}
            try:
                key = json.dumps(configs, sort_keys=True)
                if key not in packages:
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        ep = torch.export.export(module, dev_args)
                        packages[key] = torch._inductor.aoti_compile_and_package(  # noqa: SLF001
                            ep, package_path=str(scratch / f"{label}.pt2"),
                            inductor_configs=configs or None)
                    result["compile_s"] = round(time.perf_counter() - t0, 1)
                result.update(_fresh_load(packages[key], single))
            except Exception as e:
                result["error"] = f"{type(e).__name__}: {e}"[:2000]
            keep(f"aoti_{label}", result)
            print(f"aoti {label}: {result}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _fresh_load(package: str, single: str) -> dict[str, Any]:
    command = [sys.executable, "-X", "faulthandler", "-c", LOAD, package, single]
    gdb = shutil.which("gdb")
    if gdb:  # a native backtrace where it crashes
        command = [gdb, "-q", "-batch", "-ex", "run", "-ex", "bt 30", "--args", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    found: dict[str, Any] = {"rc": done.returncode, "under_gdb": bool(gdb)}
    line = next((ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("{")), "")
    if line:
        found.update(json.loads(line))
    if not found.get("ok"):
        found["stderr_tail"] = (done.stderr or "")[-3000:]
        found["stdout_tail"] = (done.stdout or "")[-3000:]
    return found


if __name__ == "__main__":  # python tests/gpu/check_parts.py [--cpu]: a dry run
    sys.path.insert(0, str(ROOT))
    if "--cpu" in sys.argv:
        DEVICE, ROWS = "cpu", (("resnet18", 1, "fp32"),)
    found: dict[str, Any] = {}
    end = time.monotonic() + 300
    parts(lambda: end - time.monotonic(), found.__setitem__)
    if cuda():
        aoti_variants(lambda: end - time.monotonic(), found.__setitem__)
    print(json.dumps(found, indent=1, default=str))
