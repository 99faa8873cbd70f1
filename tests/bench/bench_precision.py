"""What precision buys, one run, side by side, resnet18 b1 and the BERT-like encoder b1:

    python tests/bench/bench_precision.py [--json] [--quick]

ONNX Runtime fp32 in-process; OpenVINO in-process with its own default precision (no hint)
and with bf16 (where the CPU has AVX512_BF16 or AMX); cuvild fp32; cuvild `auto` at a budget
of 1e-2 without calibration inputs and with them (int8 tried); cuvild `auto` at 5e-2 with
them. cuvild runs as a daemon with one CPU device on every core, reached through the fast
path (`Client(fast=True)`, the path the precision goals are stated for). Each row: p50 / p99
ms over 30 calls per runner, timed alone in turn (5 back to back a turn: timing.py
`in_blocks`, so that OpenVINO's threads in this process and the worker's do not slow each
other's calls), and the relative error against torch eager fp32 on held-out inputs
(never the calibration inputs), with the host's CPU and flags. Goal: cuvild auto <= 0.5x
ORT fp32 and <= 1.0x OpenVINO's default, within its budget.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tests"))
sys.path.append(str(Path(__file__).resolve().parent))

from daemons import DaemonProcess, daemon_config, one_cpu  # noqa: E402
from timing import in_blocks  # noqa: E402

from cuvild.client import Client  # noqa: E402
from cuvild.client.samples import reference  # noqa: E402
from runtimes.base import set_error  # noqa: E402
from runtimes.profiling import hardware  # noqa: E402

MODELS = ("resnet18", "bert4")
CALIBRATION = 16
HELD_OUT = 8
BLOCK_SIZE = 5  # calls back to back per runner and turn
CUVILD = (("cuvild fp32", "fp32", None, False), ("cuvild auto 1e-2", "auto", 1e-2, False),
          ("cuvild auto 1e-2 + calibration", "auto", 1e-2, True),
          ("cuvild auto 5e-2 + calibration", "auto", 5e-2, True))


def inputs_like(x: torch.Tensor, n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(x.shape, generator=gen) for _ in range(n)]


def in_process(model: torch.nn.Module, x: torch.Tensor,
               threads: int) -> tuple[dict[str, Callable], str]:
    """ONNX Runtime fp32 and OpenVINO (its default precision; bf16 where the CPU has it), and
    the precision OpenVINO's default picked on this CPU."""
    import openvino as ov

    from runtimes.onnxruntime import open_session

    runners: dict[str, Callable] = {}
    default_hint = ""
    ep = torch.export.export(model, (x,))
    onnx_path = Path(tempfile.mkdtemp(prefix="cuvil-prec-")) / "model.onnx"
    torch.onnx.export(ep, (x,), dynamo=True, verbose=False).save(str(onnx_path))
    session = open_session(onnx_path, threads)
    name = session.get_inputs()[0].name
    runners["onnxruntime fp32 (in-process)"] = lambda a: session.run(None, {name: a})[0]
    core = ov.Core()
    converted = ov.convert_model(ep)
    configs = {"openvino default (in-process)": {}}
    features = hardware.cpu_features(hardware.cpuinfo()["flags"])
    if hardware.has_bf16(features):
        configs["openvino bf16 (in-process)"] = {"INFERENCE_PRECISION_HINT": "bf16"}
    for label, extra in configs.items():
        compiled = core.compile_model(converted, "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                         "PERFORMANCE_HINT": "LATENCY", **extra})
        request = compiled.create_infer_request()
        runners[label] = lambda a, r=request: r.infer([a], share_inputs=True)[0].copy()
        if not extra:
            default_hint = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
    return runners, default_hint


def one_model(name: str, root: Path, rounds: int, threads: int) -> dict[str, Any]:
    model, (x,) = reference(name)
    held = inputs_like(x, HELD_OUT, seed=1)
    calibration = inputs_like(x, CALIBRATION, seed=2)
    with torch.no_grad():
        expected = [model(h).numpy() for h in held]
    runners, default_hint = in_process(model, x, threads)
    home = root / name
    home.mkdir()
    config = daemon_config(home, home / "state", home)
    config["devices"] = one_cpu()
    config["log_level"] = "warning"
    daemon = DaemonProcess(home, config).start()
    notes: dict[str, list[str]] = {}
    try:
        with Client(daemon.target, timeout=900) as client, Client(daemon.target,
                                                                  fast=True) as fast:
            for label, policy, budget, calibrated in CUVILD:
                served = label.replace(" ", "-").replace("+", "c")
                t0 = time.perf_counter()
                client.load(served, model, (x,), precision=policy, max_error=budget,
                            calibration=calibration if calibrated else None)
                while next(m for m in client.models() if m["name"] == served)["state"] == \
                        "loading":
                    time.sleep(0.5)
                report = client.compare(served)
                notes[label] = [f"ready in {time.perf_counter() - t0:.1f} s", *[
                    f"{p['id']} {p['device']} {p['runtime']} {p['precision']}"
                    for p in report["parts"]], *report["notes"]]
                runners[label] = (lambda a, c=fast, s=served:
                                  c.infer(s, torch.from_numpy(a))["output0"].numpy())
            errors = {k: set_error([np.asarray(run(h.numpy())) for h in held], expected)
                      for k, run in runners.items()}
            a = held[0].numpy()
            samples = in_blocks({k: (lambda run=run: run(a)) for k, run in runners.items()},
                                blocks=max(1, rounds // BLOCK_SIZE), size=BLOCK_SIZE)
    finally:
        daemon.stop()
        daemon.close()
    ort = statistics.median(samples["onnxruntime fp32 (in-process)"])
    ov_default = statistics.median(samples["openvino default (in-process)"])
    rows = {k: {"p50_ms": round(statistics.median(v), 3),
                "p99_ms": round(float(np.percentile(v, 99)), 3),
                "x_ort_fp32": round(statistics.median(v) / ort, 3),
                "x_openvino_default": round(statistics.median(v) / ov_default, 3),
                "rel_error": errors[k]} for k, v in samples.items()}
    return {"model": name, "batch": 1, "openvino_default_precision": default_hint,
            "rows": rows, "cuvild": notes}


def main() -> dict[str, Any]:
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    rounds = 10 if "--quick" in sys.argv else 30
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    info = hardware.cpuinfo()
    report: dict[str, Any] = {"host": {"cpu": info["name"], "cores": threads,
                                       "flags": hardware.cpu_features(info["flags"])},
                              "models": []}
    with tempfile.TemporaryDirectory(prefix="cuvil-precbench-") as tmp:
        for name in MODELS[:1] if "--quick" in sys.argv else MODELS:
            report["models"].append(one_model(name, Path(tmp), rounds, threads))
    return report


def show(r: dict[str, Any]) -> None:
    print(f"host: {r['host']['cpu']}, {r['host']['cores']} cores, flags {r['host']['flags']}")
    for m in r["models"]:
        print(f"\n{m['model']} b{m['batch']}: p50 / p99 ms, x ORT fp32, x OpenVINO default "
              f"({m['openvino_default_precision']} here), error vs eager fp32 on held-out inputs")
        for k, row in m["rows"].items():
            print(f"  {k:<34} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f}  "
                  f"{row['x_ort_fp32']:5.2f}x  {row['x_openvino_default']:5.2f}x  "
                  f"{row['rel_error']:.1e}")
        for label, notes in m["cuvild"].items():
            print(f"  {label}: " + "; ".join(notes))


if __name__ == "__main__":
    result = main()
    if "--json" in sys.argv:
        print(json.dumps(result, indent=2))
    else:
        show(result)
