"""Micro-benchmarks that measure a device: peak matmul GFLOP/s per dtype, memory bandwidth,
host<->device copy bandwidth and latency, per-call launch overhead, and (GPUs) what a call and
each kernel of a compiled part cost through its runtime (runtimes/profiling/calls.py).

Run as a subprocess (`python -m runtimes.profiling.benchmarks SPEC_JSON`), pinned to the cores the
device's worker will own, so the numbers are those the worker will see and the daemon never
imports torch or OpenVINO just to start. Prints one JSON list of DeviceProfile dicts.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from partitioner.profile import RUNTIMES_BY_KIND
from runtimes.base import installed
from runtimes.profiling import hardware, probes

MATMUL_TARGET_S = 0.03  # grow the matmul until one call takes this long (or the size cap)
BANDWIDTH_BYTES = 128 << 20
COPY_BYTES = 64 << 20


def best_time(fn: Callable[[], Any], reps: int = 3,
              sync: Callable[[], Any] = lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def median_call_us(fn: Callable[[], Any], calls: int = 2000) -> float:
    fn()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1e3


def matmul_gflops(run_n: Callable[[int], Callable[[], Any]], cap: int = 4096,
                  sync: Callable[[], Any] = lambda: None) -> float:
    """Peak GFLOP/s of an n x n x n matmul, n doubled until a call is long enough to time."""
    n = 512
    while True:
        fn = run_n(n)
        seconds = best_time(fn, reps=3, sync=sync)
        if seconds >= MATMUL_TARGET_S or n >= cap:
            return 2 * n**3 / seconds / 1e9
        n *= 2


def handoff_us(rounds: int = 300) -> float:
    """Median round trip of a small message to another process and back over a pipe: what
    handing a part's inputs (references into the arena) to a device worker costs."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")  # the echo touches nothing of this process's libraries
    ours, theirs = ctx.Pipe()
    echo = ctx.Process(target=_echo, args=(theirs,), daemon=True)
    echo.start()
    try:
        message = ("run", "model:1", "p0", [("cuvil-1-0", 0, "float32", (1, 64))])
        return median_call_us(lambda: (ours.send(message), ours.recv()), calls=rounds)
    finally:
        ours.send(None)
        echo.join(5)


def _echo(conn: Any) -> None:
    while (message := conn.recv()) is not None:
        conn.send(message)


# ---- host CPU through torch --------------------------------------------------------------

# The module whose presence says a CPU runtime is installed ("torch" always is, here).
_CPU_MODULES = {"openvino": "openvino", "onnxruntime": "onnxruntime", "llvm-cpu": "iree.runtime",
                "torch": "torch"}


def _cpu_runtimes() -> list[str]:
    return [name for name in RUNTIMES_BY_KIND["cpu"] if installed(_CPU_MODULES[name])]


def profile_cpu(cores: list[int]) -> dict[str, Any]:
    import torch

    info = hardware.cpuinfo()
    features = hardware.cpu_features(info["flags"])
    runtimes = _cpu_runtimes()
    found, failed = probes.probe_cpu(runtimes, _dtypes(features), len(cores))
    peak, efficiency = probes.summarize(found)
    x = torch.ones(BANDWIDTH_BYTES // 4)
    read_s = best_time(lambda: x.sum(), reps=5)
    src, dst = torch.ones(COPY_BYTES // 4), torch.empty(COPY_BYTES // 4)
    copy_s = best_time(lambda: dst.copy_(src), reps=5)
    one, out = torch.ones(1), torch.empty(1)
    return {
        "id": "cpu0",
        "kind": "cpu",
        "name": info["name"],
        "memory_gb": hardware.memory_bytes() / 1e9,
        "peak_gflops": peak,
        "mem_bw_gbs": BANDWIDTH_BYTES / read_s / 1e9,
        # The host is its own "link": a cut between host parts costs at worst a memcpy.
        "link_bw_gbs": COPY_BYTES / copy_s / 1e9,
        # A cut between host parts moves no bytes (the arena is shared) but hands an order
        # to another worker and waits for its reply: that hop is the link's latency.
        "link_latency_us": handoff_us(),
        "launch_us": median_call_us(lambda: torch.add(one, one, out=out)),
        "runtimes": runtimes,
        "cores": cores,
        "features": features,
        "efficiency": efficiency,
        "probe": found,
        "probe_errors": failed,
    }


def _dtypes(features: list[str]) -> list[str]:
    """The dtypes this CPU has fast instructions for: bf16 through AMX or AVX512_BF16, int8
    through AMX or VNNI."""
    vnni = {"amx_int8", "avx512_vnni", "avx_vnni"} & set(features)
    return ["fp32"] + (["bf16"] if hardware.has_bf16(features) else []) + (
        ["int8"] if vnni else [])


# ---- CUDA GPUs through torch -------------------------------------------------------------

def profile_cuda(index: int) -> dict[str, Any]:
    import torch

    dev = torch.device("cuda", index)
    props = torch.cuda.get_device_properties(index)
    sync = torch.cuda.synchronize
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
    peak = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                         ("fp16", torch.float16)):
        def run_n(n: int, dtype: torch.dtype = dtype) -> Callable[[], Any]:
            a = torch.randn(n, n, device=dev, dtype=dtype)
            b = torch.randn(n, n, device=dev, dtype=dtype)
            return lambda: torch.mm(a, b)
        peak[label] = matmul_gflops(run_n, cap=16384, sync=sync)

    def run_int8(n: int) -> Callable[[], Any]:
        a = torch.randint(-128, 127, (n, n), dtype=torch.int8, device=dev)
        b = torch.randint(-128, 127, (n, n), dtype=torch.int8, device=dev)
        return lambda: torch._int_mm(a, b)  # noqa: SLF001 - torch's int8 matmul
    try:
        peak["int8"] = matmul_gflops(run_int8, cap=16384, sync=sync)
    except RuntimeError:
        pass

    nbytes = 1 << 30
    x = torch.ones(nbytes // 4, device=dev)
    read_s = best_time(lambda: x.sum(), reps=5, sync=sync)
    host = torch.ones(COPY_BYTES // 4).pin_memory()
    on_dev = torch.empty(COPY_BYTES // 4, device=dev)
    h2d_s = best_time(lambda: on_dev.copy_(host, non_blocking=True), reps=5, sync=sync)
    tiny_host, tiny_dev = torch.ones(1).pin_memory(), torch.empty(1, device=dev)

    def tiny_copy() -> None:
        tiny_dev.copy_(tiny_host, non_blocking=True)
        sync()

    one = torch.ones(1, device=dev)
    launches = 1000

    def launch_many() -> None:
        for _ in range(launches):
            torch.add(one, one)

    features = [f"sm_{props.major}{props.minor}", *_aoti_feature(dev)]
    return {
        "id": f"gpu{index}",
        "kind": "gpu",
        "name": props.name,
        "memory_gb": props.total_memory / 1e9,
        "peak_gflops": peak,
        "mem_bw_gbs": nbytes / read_s / 1e9,
        "link_bw_gbs": COPY_BYTES / h2d_s / 1e9,
        "link_latency_us": median_call_us(tiny_copy, calls=200),
        "launch_us": best_time(launch_many, reps=3, sync=sync) / launches * 1e6,
        "runtimes": ["triton"] if installed("triton") else [],
        "cores": [],
        "features": features,
        **_compiled_calls(dev, features),
    }


def _compiled_calls(dev: Any, features: list[str]) -> dict[str, float]:
    """call_us / kernel_us of parts compiled for `dev` (runtimes/profiling/calls.py), {} where
    triton is missing or the compile fails (the cost model then takes launch_us)."""
    if not installed("triton"):
        return {}
    from runtimes.profiling.calls import compiled_call_us
    from runtimes.triton import AOTI_BROKEN, compile_part

    aoti = AOTI_BROKEN not in features
    try:
        return compiled_call_us(lambda part, inputs: compile_part(part, inputs, dev,
                                                                  aoti=aoti),
                                lambda run: median_call_us(run, calls=200))
    except Exception as e:  # noqa: BLE001 - the profile stands without it
        print(f"note: {dev}: compiled-part timing failed ({type(e).__name__}: {e}); the cost "
              "model prices its kernels at launch_us", file=sys.stderr)
        return {}


def _aoti_feature(dev: Any) -> list[str]:
    """[AOTI_BROKEN] where AOTInductor fails its check on `dev` (runtimes/triton.py)."""
    if not installed("triton"):
        return []
    from runtimes.triton import AOTI_BROKEN, aoti_check

    reason = aoti_check(dev, timeout_s=180)
    if reason is None:
        return []
    print(f"note: {dev}: {reason}; its parts are compiled with torch.compile",
          file=sys.stderr)
    return [AOTI_BROKEN]


# ---- OpenVINO devices (real NPU / GPU, or an emulated device on the CPU plugin) -----------

def _ov_matmul(core: Any, device: str, config: dict[str, Any], n: int) -> Callable[[], Any]:
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    a = ops.parameter([n, n], ov.Type.f32, name="a")
    b = ops.constant(np.random.rand(n, n).astype(np.float32))
    model = ov.Model([ops.matmul(a, b, False, False)], [a])
    request = core.compile_model(model, device, config).create_infer_request()
    x = np.random.rand(n, n).astype(np.float32)
    return lambda: request.infer([x], share_inputs=True)


def _ov_reduce(core: Any, device: str, config: dict[str, Any], n: int) -> Callable[[], Any]:
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    # Rows reduced along their last axis: the CPU plugin reduces a single long vector on one
    # lane (4 GB/s measured on a core that streams 17-20 GB/s through rows, torch or numpy).
    rows = 4096 if n >= 4096 * 64 else 1
    a = ops.parameter([rows, n // rows], ov.Type.f32, name="a")
    model = ov.Model([ops.reduce_sum(a, ops.constant(np.array([1], np.int64)), False)], [a])
    request = core.compile_model(model, device, config).create_infer_request()
    x = np.ones((rows, n // rows), np.float32)
    return lambda: request.infer([x], share_inputs=True)


def profile_openvino(dev_id: str, kind: str, ov_device: str, cores: list[int],
                     emulated: bool) -> dict[str, Any]:
    import numpy as np
    import openvino as ov

    core = ov.Core()
    base: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
    if ov_device == "CPU":
        base["INFERENCE_NUM_THREADS"] = len(cores)
    precisions = {"fp32": "f32"}
    features = hardware.cpu_features(hardware.cpuinfo()["flags"]) if ov_device == "CPU" else []
    if ov_device != "CPU" or hardware.has_bf16(features):
        precisions["bf16" if ov_device == "CPU" else "fp16"] = (
            "bf16" if ov_device == "CPU" else "f16")
    peak: dict[str, float] = {}
    efficiency: dict[str, float] = {}
    found: dict[str, Any] = {}
    if ov_device == "CPU":  # the CPU plugin's own matmul and conv kernels, per dtype
        found = {"openvino": probes.openvino_probes(
            sorted(set(precisions) | set(_dtypes(features))), len(cores))}
        peak, efficiency = probes.summarize(found)
    for label, hint in precisions.items():
        if label not in peak:
            config = {**base, "INFERENCE_PRECISION_HINT": hint}
            peak[label] = matmul_gflops(lambda n, c=config: _ov_matmul(core, ov_device, c, n))
    config = {**base, "INFERENCE_PRECISION_HINT": "f32"}
    n = BANDWIDTH_BYTES // 4
    read_s = best_time(_ov_reduce(core, ov_device, config, n), reps=5)
    tiny = _ov_reduce(core, ov_device, config, 16)
    src, dst = np.ones(COPY_BYTES, np.uint8), np.empty(COPY_BYTES, np.uint8)
    copy_s = best_time(lambda: np.copyto(dst, src), reps=5)
    small_src, small_dst = np.ones(64, np.uint8), np.empty(64, np.uint8)
    name = core.get_property(ov_device, "FULL_DEVICE_NAME")
    if emulated:
        name = f"emulated {kind.upper()} (OpenVINO {ov_device} plugin on cores {cores}): {name}"
    return {
        "id": dev_id,
        "kind": kind,
        "name": name,
        "emulated": emulated,
        "memory_gb": hardware.memory_bytes() / 1e9,
        "peak_gflops": peak,
        "mem_bw_gbs": BANDWIDTH_BYTES / read_s / 1e9,
        # Emulated and integrated devices share host memory: a transfer is at worst a memcpy.
        "link_bw_gbs": COPY_BYTES / copy_s / 1e9,
        "link_latency_us": handoff_us() if emulated else median_call_us(
            lambda: np.copyto(small_dst, small_src)),
        "launch_us": median_call_us(tiny, calls=500),
        "runtimes": ["openvino"],
        "cores": cores,
        "features": features,
        "efficiency": efficiency,
        "probe": found,
    }


def _openvino_devices() -> list[tuple[str, str]]:
    """(kind, OpenVINO device name) for the real NPUs and GPUs OpenVINO sees."""
    if not installed("openvino"):
        return []
    import openvino as ov

    found = []
    for name in ov.Core().available_devices:
        if name.startswith("NPU"):
            found.append(("npu", name))
        elif name.startswith("GPU"):
            found.append(("gpu", name))
    return found


# ---- entry --------------------------------------------------------------------------------

def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Measure what `spec` asks for; see runtimes/profiling/measure.py for the spec's shape."""
    cores = spec.get("cores") or hardware.usable_cores()
    os.sched_setaffinity(0, cores)
    if spec["task"] == "emulated":
        return [profile_openvino(spec["id"], spec["kind"], "CPU", cores, emulated=True)]
    import torch

    torch.set_num_threads(len(cores))
    profiles = []
    if spec.get("cpu", True):
        profiles.append(profile_cpu(cores))
    if spec.get("gpu", True) and torch.cuda.is_available():
        profiles += [profile_cuda(i) for i in range(torch.cuda.device_count())]
    if spec.get("openvino", True):
        counts: dict[str, int] = {}
        for kind, ov_name in _openvino_devices():
            index = counts.get(kind, 0) + (torch.cuda.device_count() if kind == "gpu" else 0)
            counts[kind] = counts.get(kind, 0) + 1
            profiles.append(profile_openvino(f"{kind}{index}", kind, ov_name, [], False))
    return profiles


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
