"""Matmul and conv probes through each runtime that can serve the host CPU: the kernels the
parts will really run (torch's, OpenVINO's CPU plugin's, ONNX Runtime's), per dtype the ISA
has (bf16 through AMX or AVX512_BF16, int8 through AMX or VNNI).

A device's peak is then the best runtime's matmul rate (`auto` runs each part on the fastest
runtime), and its conv efficiency the best conv rate over that peak. Each rate is the median
of several short timed calls at a size grown until one call takes `CALL_S`, so one preempted
call does not move it; the spread ((p90 - p10) / median) is reported with it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

CALL_S = 0.01  # grow a probe until one call takes this long
RUNS = 7  # timed calls per probe; their median is the rate
CONV = (64, 56, 3)  # channels, spatial size, kernel: a ResNet-18 stage-1 convolution


def rate(make: Callable[[int], Callable[[], Any]], flops: Callable[[int], float],
         start: int, cap: int) -> tuple[float, float]:
    """(GFLOP/s, spread) of the probe `make(n)`, n doubled from `start` up to `cap` until one
    call is long enough to time."""
    n = start
    while True:
        fn = make(n)
        fn()
        t0 = time.perf_counter()
        fn()
        if time.perf_counter() - t0 >= CALL_S or n >= cap:
            break
        n *= 2
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    median = statistics.median(times)
    spread = (times[-2] - times[1]) / median  # p90 - p10 of 7: drop the extreme of each side
    return flops(n) / median / 1e9, spread


def _matmul_flops(n: int) -> float:
    return 2.0 * n**3


def _conv_flops(batch: int) -> float:
    c, s, k = CONV
    return 2.0 * batch * c * c * k * k * s * s


# ---- torch ---------------------------------------------------------------------------------

def torch_probes(dtypes: list[str]) -> dict[str, tuple[float, float]]:
    import torch

    out = {}
    for label in dtypes:
        if label == "int8":
            def mm8(n: int) -> Callable[[], Any]:
                a = torch.randint(-128, 127, (n, n), dtype=torch.int8)
                b = torch.randint(-128, 127, (n, n), dtype=torch.int8)
                return lambda: torch._int_mm(a, b)  # noqa: SLF001 - torch's int8 matmul
            try:
                out["matmul/int8"] = rate(mm8, _matmul_flops, 256, 2048)
            except RuntimeError:  # no int8 matmul kernel in this torch build
                pass
            continue
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[label]

        def mm(n: int, dtype: torch.dtype = dtype) -> Callable[[], Any]:
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            return lambda: torch.mm(a, b)

        def conv(batch: int, dtype: torch.dtype = dtype) -> Callable[[], Any]:
            c, s, k = CONV
            x = torch.randn(batch, c, s, s).to(dtype)
            w = torch.randn(c, c, k, k).to(dtype)
            return lambda: torch.nn.functional.conv2d(x, w, padding=k // 2)

        with torch.inference_mode():
            out[f"matmul/{label}"] = rate(mm, _matmul_flops, 256, 4096)
            out[f"conv/{label}"] = rate(conv, _conv_flops, 1, 64)
    return out


# ---- OpenVINO (CPU plugin) -----------------------------------------------------------------

def openvino_probes(dtypes: list[str], threads: int) -> dict[str, tuple[float, float]]:
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    core = ov.Core()
    hints = {"fp32": "f32", "bf16": "bf16"}
    out = {}
    for label in [d for d in dtypes if d in hints]:
        config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads,
                  "INFERENCE_PRECISION_HINT": hints[label]}

        def compiled(model: Any, x: np.ndarray, config: dict = config) -> Callable[[], Any]:
            request = core.compile_model(model, "CPU", config).create_infer_request()
            return lambda: request.infer([x], share_inputs=True)

        def mm(n: int) -> Callable[[], Any]:
            a = ops.parameter([n, n], ov.Type.f32, name="a")
            b = ops.constant(np.random.rand(n, n).astype(np.float32))
            return compiled(ov.Model([ops.matmul(a, b, False, False)], [a]),
                            np.random.rand(n, n).astype(np.float32))

        def conv(batch: int) -> Callable[[], Any]:
            c, s, k = CONV
            x = ops.parameter([batch, c, s, s], ov.Type.f32, name="x")
            w = ops.constant(np.random.rand(c, c, k, k).astype(np.float32))
            y = ops.convolution(x, w, [1, 1], [k // 2, k // 2], [k // 2, k // 2], [1, 1])
            return compiled(ov.Model([y], [x]),
                            np.random.rand(batch, c, s, s).astype(np.float32))

        out[f"matmul/{label}"] = rate(mm, _matmul_flops, 256, 4096)
        out[f"conv/{label}"] = rate(conv, _conv_flops, 1, 64)
    if "int8" in dtypes:  # what NNCF's quantized parts run: FakeQuantize -> int8 GEMM
        config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads}

        def fq(node: Any) -> Any:
            lo, hi = ops.constant(np.float32(-4.0)), ops.constant(np.float32(4.0))
            return ops.fake_quantize(node, lo, hi, lo, hi, 256)

        def mm8(n: int) -> Callable[[], Any]:
            a = ops.parameter([n, n], ov.Type.f32, name="a")
            b = ops.constant(np.random.rand(n, n).astype(np.float32))
            model = ov.Model([ops.matmul(fq(a), fq(b), False, False)], [a])
            request = core.compile_model(model, "CPU", config).create_infer_request()
            x = np.random.rand(n, n).astype(np.float32)
            return lambda: request.infer([x], share_inputs=True)

        out["matmul/int8"] = rate(mm8, _matmul_flops, 256, 4096)
    return out


# ---- ONNX Runtime (CPU execution provider) ------------------------------------------------

def onnxruntime_probes(threads: int) -> dict[str, tuple[float, float]]:
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")

    def session(node: Any, x_shape: list[int], weight: np.ndarray,
                y_shape: list[int]) -> Callable[[], Any]:
        graph = helper.make_graph(
            [node], "probe",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
            [numpy_helper.from_array(weight, "w")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                  ir_version=8)  # what every ORT since 1.10 reads
        sess = ort.InferenceSession(model.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])
        x = np.random.rand(*x_shape).astype(np.float32)
        return lambda: sess.run(None, {"x": x})

    def mm(n: int) -> Callable[[], Any]:
        return session(helper.make_node("MatMul", ["x", "w"], ["y"]), [n, n],
                       np.random.rand(n, n).astype(np.float32), [n, n])

    def conv(batch: int) -> Callable[[], Any]:
        c, s, k = CONV
        node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[k // 2] * 4)
        return session(node, [batch, c, s, s], np.random.rand(c, c, k, k).astype(np.float32),
                       [batch, c, s, s])

    return {"matmul/fp32": rate(mm, _matmul_flops, 256, 4096),
            "conv/fp32": rate(conv, _conv_flops, 1, 64)}


def probe_cpu(runtimes: list[str], dtypes: list[str], threads: int) -> tuple[
        dict[str, dict[str, tuple[float, float]]], dict[str, str]]:
    """runtime -> "op/dtype" -> (GFLOP/s, spread), for the installed runtimes, and runtime ->
    why its probe failed (a runtime's failure is not the device's: the others still count)."""
    probes: dict[str, Callable[[], dict[str, tuple[float, float]]]] = {
        "torch": lambda: torch_probes(dtypes),
        "openvino": lambda: openvino_probes(dtypes, threads),
        "onnxruntime": lambda: onnxruntime_probes(threads),
    }
    out, failed = {}, {}
    for name in runtimes:
        if name in probes:
            try:
                out[name] = probes[name]()
            except Exception as e:  # noqa: BLE001 - reported with the profile
                failed[name] = f"{type(e).__name__}: {e}"[:300]
    return out, failed


def summarize(found: dict[str, dict[str, tuple[float, float]]]) -> tuple[
        dict[str, float], dict[str, float]]:
    """Peak GFLOP/s per dtype (the best runtime's matmul) and efficiency per op class (the best
    runtime's conv rate over the fp32 peak)."""
    peak: dict[str, float] = {}
    conv: dict[str, float] = {}
    for results in found.values():
        for key, (gflops, _) in results.items():
            op, dtype = key.split("/")
            table = peak if op == "matmul" else conv
            table[dtype] = max(table.get(dtype, 0.0), gflops)
    efficiency = {}
    if "fp32" in conv and peak.get("fp32"):
        efficiency["conv"] = round(conv["fp32"] / peak["fp32"], 3)
    return peak, efficiency
